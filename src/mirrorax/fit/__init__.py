"""``fit`` and its kin, below the Trainer: the preparation and its record (``fit_plan``), the epoch loop
(``loop``) and its hooks (``epoch``), the callbacks driver (``hooks``), progress output (``progress``), the
planner (``planner``: ``mx.plan``), the state on the devices (``device_state``) and the compilation cache
(``cache``). Imports nothing: each module stands on its own floor."""
