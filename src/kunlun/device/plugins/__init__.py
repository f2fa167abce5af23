"""Built-in device plugins, one module per vendor family.

Each registers in the ``kunlun.device_plugins`` entry-point group (see pyproject.toml), the
same way a vendor's own package would.
"""
