"""Command-line interfaces: ``kunlun-cli`` and ``kunlun-device-probe``."""
