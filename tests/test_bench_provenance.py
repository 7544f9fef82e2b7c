"""What a bench or loadtest report says produced it: never a secret, never another project's commit."""

from __future__ import annotations

import subprocess

from kiln.pipeline.bench.provenance import checkout_commit, redacted


def test_an_api_key_on_the_command_line_is_redacted_in_the_report():
    argv = ["loadtest", "http://h:8000", "--api-key", "s3cr3t", "--api-key=other", "--requests", "4"]
    assert redacted(argv) == ["loadtest", "http://h:8000", "--api-key", "***", "--api-key=***", "--requests", "4"]


def test_only_kilns_own_checkout_gives_a_commit(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    installed = tmp_path / ".venv" / "site-packages" / "kiln"  # a wheel in another project's virtualenv
    installed.mkdir(parents=True)
    assert checkout_commit(installed) is None  # before: that project's commit
    assert checkout_commit(tmp_path / "absent") is None
