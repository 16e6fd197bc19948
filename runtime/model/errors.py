"""Errors a user can cause when naming a model: shown as one clear line, never a traceback."""


class ModelLoadError(Exception):
    """The model could not be loaded (missing file, unsupported architecture or quantization...)."""
