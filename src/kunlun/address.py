"""Where the daemon listens unless told otherwise: the one owner of the default host and
port, from which every default address is derived (the daemon's bind, the CLI's endpoint,
the unit file the offline installer writes, the doctor's port check, help texts). Standard
library only: the installer's zipapp carries it."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
DEFAULT_ENDPOINT = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
