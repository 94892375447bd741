"""verl-tide: TideRL's readiness-aware scheduling for multi-turn agentic RL on verl 0.9.x.

Importing this package is side-effect free: verl finds the plugin through the
`verl.plugins` entry point (`verl_tide.register`) and Hydra through
`hydra_plugins.verl_tide_searchpath`. Nothing here touches verl until one of those runs.
"""

__version__ = "0.1.0.dev0"
