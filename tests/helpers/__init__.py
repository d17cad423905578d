"""Helpers shared by the test modules (imported as ``helpers.<module>``; tests/ is on sys.path)."""
