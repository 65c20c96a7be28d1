"""Shipped configs. In the wheel this folder is the package ``scaleopt.configs`` (package data);
``scaleopt.config.resolve_config`` finds a config by name (``--config tiny``)."""
