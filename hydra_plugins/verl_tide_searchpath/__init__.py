"""Hydra search-path plugin: makes the config group `tide` visible to every Hydra app.

Hydra imports every module under the `hydra_plugins` namespace at start-up, in every
Hydra app on the machine, so this module imports nothing but Hydra's plugin base.
Appending a search path adds the group `tide`; it changes nothing until a user
selects `+tide=enabled`.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VerlTideSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="verl-tide", path="pkg://verl_tide.conf")
