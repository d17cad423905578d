"""The lab: tools that prove the library (the demo trainer, ``compare``, the emulated cluster,
``simulate``, ``bench``, ``list`` and the ``gradzip`` command). Installed with the ``lab``
extra (``pip install "gradzip[lab]"``); the core never imports it."""
