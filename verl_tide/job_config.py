"""Read the `tide:` subtree out of a composed verl job config (OmegaConf) into a `TideConfig`."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl_tide.config import TideConfig, TideConfigError, parse_tide_config

TRAINER_MODE = "tide"


def tide_config_from_job(config: DictConfig) -> TideConfig:
    """Validate `config.tide`; raise `TideConfigError` naming each bad key.

    A job that selects `trainer.v1.trainer_mode=tide` without the subtree is told how to add it.
    """
    raw: Any = OmegaConf.select(config, "tide", default=None)
    if raw is None:
        mode = OmegaConf.select(config, "trainer.v1.trainer_mode", default=None)
        if mode == TRAINER_MODE:
            raise TideConfigError(
                ["tide = <missing>: trainer.v1.trainer_mode=tide needs the tide: subtree; add `+tide=enabled`"]
            )
        return parse_tide_config({})
    if isinstance(raw, DictConfig):
        missing = sorted(OmegaConf.missing_keys(raw))
        if missing:  # `???` in a recipe: a value the user must give
            raise TideConfigError([f"tide.{key} = ??? (missing): set it on the command line, e.g. tide.{key}=..."
                                   for key in missing])
    try:
        container = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else raw
    except Exception as e:  # an interpolation inside tide: that does not resolve
        raise TideConfigError([f"tide = <unresolvable>: {e}"]) from e
    return parse_tide_config(container)
