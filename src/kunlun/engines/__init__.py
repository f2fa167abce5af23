"""External and embedded inference engines behind one adapter (docs/engines.md).

Kept apart from :mod:`kunlun.engine`, the embedded PyTorch engine: this package only
describes engines (formats, device types, installed or not, the command of a plan) and
chooses one; it imports no engine.
"""
