"""Bridges to optional packages. The only place in the core where a package beyond torch and
numpy may be imported, and then only inside a function, when the feature that needs it is used."""
