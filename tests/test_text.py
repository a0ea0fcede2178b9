"""Loading evaluation text: the one-document / one-row rule and every bad-input message."""

from __future__ import annotations

import json

import pytest

from gqakit.errors import GqakitError
from gqakit.text import load_texts


def test_txt_is_one_document_verbatim(tmp_path):
    text = "First paragraph.\n\nSecond paragraph, café.\n"
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    assert load_texts(str(path)) == [text]


def test_jsonl_gives_one_document_per_row_and_drops_empty_rows(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"body": "one"}, {"body": "  "}, {"body": "two"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_texts(str(path), text_field="body") == ["one", "two"]


def test_parquet(tmp_path):
    import datasets

    path = tmp_path / "a.parquet"
    datasets.Dataset.from_list([{"text": "alpha"}, {"text": "beta"}]).to_parquet(str(path))
    assert load_texts(str(path)) == ["alpha", "beta"]


@pytest.mark.parametrize(
    "name, content, field, message",
    [
        ("missing.txt", None, "text", "does not exist"),
        ("missing.jsonl", None, "text", "does not exist"),
        ("empty.txt", "", "text", "holds no text"),
        ("blank.jsonl", '{"text": ""}\n{"text": " "}\n', "text", "holds no text"),
        ("rows.jsonl", '{"body": "x"}\n', "text", "has no field 'text'; its fields are body"),
    ],
)
def test_bad_data(tmp_path, name, content, field, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(GqakitError, match=message):
        load_texts(str(path), text_field=field)


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(GqakitError, match="not UTF-8"):
        load_texts(str(path))


def test_hub_dataset_offline_is_a_clear_error():
    with pytest.raises(GqakitError, match="could not be loaded"):
        load_texts("no-such-owner/no-such-dataset")


@pytest.mark.parametrize("option", ["--ppl-data", "--calib-data", "--eval-data"])
@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("rows.jsonl", '{"body": "x"}\n')])
def test_messages_name_the_option_the_data_came_from(tmp_path, option, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(GqakitError) as err:
        load_texts(str(path), option=option)
    assert str(err.value.message).startswith(f"{option} {path}")
