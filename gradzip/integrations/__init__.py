"""Bridges to optional packages. The only place in the core where a package beyond torch and
numpy may be imported, and then only inside a function, when the feature that needs it is used."""

#: the bridges, imported on first use (``gradzip.integrations.accelerate.register`` after a
#: plain ``import gradzip``); each imports its framework only when called
_BRIDGES = ("accelerate", "hf", "lightning", "tensorboard")


def __getattr__(name: str):
    if name in _BRIDGES:
        import importlib

        return importlib.import_module(f"gradzip.integrations.{name}")
    raise AttributeError(f"module 'gradzip.integrations' has no attribute {name!r}")
