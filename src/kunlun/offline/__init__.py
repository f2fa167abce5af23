"""Signed offline delivery: model packages, the offline bundle, the installer."""
