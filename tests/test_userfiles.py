"""The one reader of the user's files (swiftwrite/base/userfiles.py): every kind of file a user names is refused in one
sentence of its own kind's exception that names the file and says what to give instead, and a good file's text
comes back exactly as written."""

from __future__ import annotations

import errno

import pytest

from swiftwrite.base import userfiles
from swiftwrite.decoding.bans import BAN_FILE, PhraseError
from swiftwrite.base.config import YAML_FILE
from swiftwrite.run.edits import EDITED
from swiftwrite.base.errors import UsageError, UserError
from swiftwrite.run.outline import OUTLINE_FILE
from swiftwrite.io.prompt import PROMPT, SOURCE

KINDS = {"prompt": PROMPT, "source": SOURCE, "outline": OUTLINE_FILE, "config": YAML_FILE, "edited": EDITED,
         "ban-file": BAN_FILE}
ERRORS = {"prompt": UserError, "source": UserError, "outline": UsageError, "config": UsageError, "edited": UserError,
          "ban-file": PhraseError}

# The sentences users saw before the reader was one function, word for word ({p}: the path).
SAID = {
    ("prompt", "missing"): "prompt file {p} does not exist.",
    ("prompt", "directory"): "prompt {p} is a directory; give a text file (or - for standard input).",
    ("prompt", "unreadable"): "prompt file {p} cannot be read (Permission denied).",
    ("prompt", "too large"): "the prompt in {p} is over 1 MB; a prompt must fit the model's context, shorten it.",
    ("prompt", "binary"): "the prompt in {p} looks binary (it contains NUL bytes); give a UTF-8 text file.",
    ("prompt", "latin-1"): "the prompt in {p} is not valid UTF-8 (byte 3); convert it to UTF-8.",
    ("prompt", "blank"): "the prompt in {p} is empty; write a brief of what the document should be.",
    ("source", "missing"): "--source file {p} does not exist.",
    ("source", "directory"): "--source {p} is a directory; give a text file.",
    ("source", "unreadable"): "--source file {p} cannot be read (Permission denied).",
    ("source", "too large"): "the --source in {p} is over 1 MB; a prompt must fit the model's context, shorten it.",
    ("source", "binary"): "the --source in {p} looks binary (it contains NUL bytes); give a UTF-8 text file.",
    ("source", "latin-1"): "the --source in {p} is not valid UTF-8 (byte 3); convert it to UTF-8.",
    ("source", "blank"): "the --source in {p} is empty; give the document the text should draw on.",
    ("outline", "missing"): "--outline {p} does not exist; give a Markdown file with one '## ' heading per section.",
    ("outline", "directory"): "--outline {p} is a directory; give a Markdown file with one '## ' heading per section.",
    ("outline", "unreadable"): "--outline {p} cannot be read (Permission denied); check its permissions.",
    ("outline", "too large"): "--outline {p} is not a Markdown outline (binary or over 1 MB); give a text file of "
                              "headings.",
    ("outline", "binary"): "--outline {p} is not a Markdown outline (binary or over 1 MB); give a text file of headings.",
    ("outline", "latin-1"): "--outline {p} is not valid UTF-8 (byte 3); convert it to UTF-8.",
    ("config", "missing"): "config file {p} does not exist.",
    ("config", "directory"): "config file {p} is a directory; give a YAML file.",
    ("config", "unreadable"): "config file {p} cannot be read (Permission denied).",
    ("config", "latin-1"): "config file {p} is not UTF-8 text; give a YAML file.",
    ("edited", "missing"): "--edited {p} does not exist; give the document file you edited.",
    ("edited", "directory"): "--edited {p} is a directory; give the document file you edited.",
    ("edited", "unreadable"): "--edited {p} cannot be read (Permission denied); check its permissions.",
    ("edited", "binary"): "--edited {p} is not text (it contains NUL bytes); give the edited document as UTF-8 text.",
    ("edited", "latin-1"): "--edited {p} is not UTF-8 text (byte 3); save it as UTF-8 and try again.",
    ("edited", "blank"): "--edited {p} is empty; to start over, start a new run instead.",
    ("ban-file", "missing"): "--ban-file {p} does not exist; give a text file with one phrase per line.",
    ("ban-file", "directory"): "--ban-file {p} is a directory; give a text file with one phrase per line.",
    ("ban-file", "unreadable"): "--ban-file {p} cannot be read (Permission denied).",
    ("ban-file", "binary"): "--ban-file {p} is not UTF-8 text; give a text file with one phrase per line.",
    ("ban-file", "latin-1"): "--ban-file {p} is not UTF-8 text; give a text file with one phrase per line.",
}
CONTENT = {"too large": b"word " * ((1 << 20) // 5 + 1), "binary": b"rain\x00\x01", "latin-1": "caf\u00e9".encode("latin-1"),
           "blank": b"  \n\t\n"}


def _refused(kind: str, case: str, tmp_path, monkeypatch) -> tuple[str, object]:
    path = tmp_path / "the file.txt"
    if case == "directory":
        path = tmp_path
    elif case == "unreadable":  # chmod does not stop root, which these tests may run as
        path.write_text("fine")

        def refused(*a, **k):
            raise PermissionError(errno.EACCES, "Permission denied", str(a[0]))

        monkeypatch.setattr(userfiles, "open", refused, raising=False)
    elif case != "missing":
        path.write_bytes(CONTENT[case])
    with pytest.raises(UserError) as e:
        userfiles.read_text(path, KINDS[kind])
    return e, path


@pytest.mark.parametrize("kind, case", sorted(SAID), ids=[f"{k}-{c}" for k, c in sorted(SAID)])
def test_each_kind_says_what_it_said_before_in_its_own_exception(kind, case, tmp_path, monkeypatch):
    e, path = _refused(kind, case, tmp_path, monkeypatch)
    assert type(e.value) is ERRORS[kind]
    assert str(e.value) == SAID[kind, case].format(p=path)
    assert "\n" not in str(e.value)
    assert e.value.__suppress_context__ or e.value.__context__ is None  # no OSError chained to print beneath it


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_good_file_comes_back_exactly_as_written(kind, tmp_path):
    text = "## Caf\u00e9 au lait\r\nUn peu de pluie \u2014 and a tab\t.\n\n"
    (tmp_path / "f").write_text(text, encoding="utf-8", newline="")
    assert userfiles.read_text(tmp_path / "f", KINDS[kind]) == text


def test_an_endless_file_is_refused_after_reading_one_byte_past_the_limit():
    with pytest.raises(UserError, match="over 1 MB"):
        userfiles.read_text("/dev/zero", PROMPT)


def test_only_the_outline_drops_a_byte_order_mark(tmp_path):
    (tmp_path / "f").write_bytes(b"\xef\xbb\xbf## One\n")
    assert userfiles.read_text(tmp_path / "f", OUTLINE_FILE) == "## One\n"
    assert userfiles.read_text(tmp_path / "f", PROMPT) == "\ufeff## One\n"  # the brief as the user wrote it


def test_standard_input_is_named_as_such():
    with pytest.raises(UserError) as e:
        userfiles.decode(b"", "standard input", PROMPT)
    assert str(e.value) == "the prompt in standard input is empty; write a brief of what the document should be."


def test_a_size_limit_comes_with_its_sentence():
    with pytest.raises(ValueError):
        userfiles.Kind("x", "give y", limit=10)
