"""Config habits of YAML: an empty section is its defaults, a key YAML reads as no name is refused at its own line,
and a section given a value says so without naming Kiln's classes."""

from __future__ import annotations

import pytest

from kiln.pipeline.config import ConfigError, load_config


def write(tmp_path, text: str):
    path = tmp_path / "kiln.yaml"
    path.write_text("model:\n  path: org/model\n" + text)
    return path


def test_an_empty_section_takes_its_defaults(tmp_path):
    config = load_config(write(tmp_path, "build:\nserve:\ncache:\n")).config
    assert config.build.max_seq_len == 2048 and config.serve.port == 8000 and not config.build.model_fields_set


def test_an_empty_model_section_says_what_it_needs(tmp_path):
    path = tmp_path / "kiln.yaml"
    path.write_text("model:\n")
    with pytest.raises(ConfigError, match=rf"^{path}:1: model.path: is required$"):
        load_config(path)


@pytest.mark.parametrize(("text", "line", "message"), [
    ("null: 2\n", 3, "the top level: key null is read as null"),
    ("build:\n  max_seq_len: 512\n  true: 3\n", 5, "build: key true is read as a boolean"),
    ("build:\n  8: 3\n", 4, "build: key 8 is read as a number"),
])
def test_a_key_yaml_reads_as_no_name_is_refused_at_its_own_line(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}:{line}: {message}.*quote it"):
        load_config(path)


def test_a_section_given_a_value_says_so_without_naming_a_class(tmp_path):
    path = write(tmp_path, "build: 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}:3: build: Input should be a mapping of settings (got 3)"


@pytest.mark.parametrize(("text", "words"), [
    ("model:\n  path: ''\n", "model.path is empty"),  # before: the config's own folder
    ("model:\n  path: ~\n", "YAML reads ~ and an empty value as null: quote the value"),
    ("model:\n  path: m\nquantize:\n  format: none\n  fallback: [fp8]\n", "nothing falls back from it"),
])
def test_an_empty_or_null_path_and_a_fallback_from_none_are_refused_saying_why(tmp_path, text, words):
    (tmp_path / "kiln.yaml").write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config(tmp_path / "kiln.yaml")
