"""The configuration object: defaults < --config YAML < SWIFTWRITE_* environment < flags, and one sentence
(a UsageError) for every value that cannot be used, whichever of the three it came from."""

from __future__ import annotations

import math

import pytest

from swiftwrite.base.config import FIELDS, Config, coerce, resolve
from swiftwrite.base.errors import UsageError

NO_FLAGS: dict = {}


def yaml_file(tmp_path, text: str):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".") and len(msg) < 300, msg
    return msg


# ---------------------------------------------------------------------------------------------------------
# precedence


def test_defaults_are_valid_and_every_field_has_a_default():
    cfg = resolve(None, NO_FLAGS, environ={})
    assert cfg == Config()
    assert set(cfg.to_dict()) == set(FIELDS)


def test_yaml_overrides_defaults(tmp_path):
    cfg = resolve(yaml_file(tmp_path, "tokens: 50\ntemperature: 0\ndraft: none\n"), NO_FLAGS, environ={})
    assert (cfg.tokens, cfg.temperature, cfg.draft) == (50, 0.0, "none")
    assert cfg.top_p == Config().top_p  # untouched fields keep their defaults


def test_environment_overrides_yaml(tmp_path):
    cfg = resolve(yaml_file(tmp_path, "tokens: 50\nseed: 3\n"), NO_FLAGS, environ={"SWIFTWRITE_TOKENS": "70"})
    assert (cfg.tokens, cfg.seed) == (70, 3)


def test_flags_override_environment_and_yaml(tmp_path):
    cfg = resolve(yaml_file(tmp_path, "tokens: 50\nmin_p: 0.2\n"), {"tokens": "90", "min_p": None},
                  environ={"SWIFTWRITE_TOKENS": "70", "SWIFTWRITE_MIN_P": "0.3"})
    assert cfg.tokens == 90  # flag beats env beats YAML
    assert cfg.min_p == 0.3  # a flag left unset (None) does not hide the environment


def test_yaml_keys_may_use_dashes_like_the_flags(tmp_path):
    cfg = resolve(yaml_file(tmp_path, "top-p: 0.9\npenalty-window: 64\n"), NO_FLAGS, environ={})
    assert (cfg.top_p, cfg.penalty_window) == (0.9, 64)


def test_unrelated_swiftwrite_variables_are_ignored():
    # SWIFTWRITE_HOME (the model store) and test hooks share the prefix but are not options.
    env = {"SWIFTWRITE_HOME": "/somewhere", "SWIFTWRITE_SLOW_CHECKPOINT": "0.5", "HOME": "/root"}
    assert resolve(None, NO_FLAGS, environ=env) == Config()


def test_environment_booleans_accept_the_usual_spellings():
    for word, value in (("1", True), ("true", True), ("Yes", True), ("off", False), ("0", False)):
        assert resolve(None, NO_FLAGS, environ={"SWIFTWRITE_STOP_AT_EOS": word}).stop_at_eos is value


def test_empty_yaml_means_defaults(tmp_path):
    assert resolve(yaml_file(tmp_path, "# nothing set\n"), NO_FLAGS, environ={}) == Config()


def test_a_saved_run_configuration_is_the_base_below_yaml(tmp_path):
    base = Config(tokens=33, seed=9).to_dict()
    cfg = resolve(yaml_file(tmp_path, "seed: 4\n"), NO_FLAGS, environ={}, base=base)
    assert (cfg.tokens, cfg.seed) == (33, 4)


def test_a_run_saved_before_an_option_existed_resumes_as_it_started():
    """A run directory written before n-gram suppression existed has no dry_* keys: resuming it must not
    switch the suppression on halfway (the text would no longer be what the run was writing)."""
    base = {k: v for k, v in Config(tokens=33).to_dict().items()
            if not k.startswith("dry_") and k not in ("stop_on_loop", "weights")}
    cfg = resolve(None, NO_FLAGS, environ={}, base=base)
    assert cfg.dry_multiplier == 0 and cfg.stop_on_loop == 0
    assert cfg.weights == "float"  # saved before quantized weights existed: the float weights it was written with
    assert resolve(None, NO_FLAGS, environ={}, base=Config(tokens=33, weights="int4").to_dict()).weights == "int4"
    assert resolve(None, NO_FLAGS, environ={}, base=Config(tokens=33).to_dict()).dry_multiplier == Config().dry_multiplier


def test_breakers_are_comma_separated_strings_with_escapes():
    from swiftwrite.base.config import breaker_strings

    assert breaker_strings("\\n") == ["\n"]
    assert breaker_strings("\\n,:,\\,,\\\\") == ["\n", ":", ",", "\\"]
    assert breaker_strings("none") == []


# ---------------------------------------------------------------------------------------------------------
# bad values: one sentence naming where the value came from


@pytest.mark.parametrize("text, needle", [
    ("tokens: 5\nfrobnicate: 1\n", "unknown option 'frobnicate'"),
    ("tokens: [1, 2]\n", "tokens"),
    ("tokens: 1.5\n", "whole number"),
    ("temperature: hot\n", "temperature"),
    ("stop_at_eos: maybe\n", "true or false"),
    ("model: null\n", "model"),
    ("draft: true\n", "draft"),
    ("- tokens: 5\n", "mapping"),
    ("just a string\n", "mapping"),
    ("tokens: [5\n", "not valid YAML"),
    ("tokens: 5\n\ttemperature: 0\n", "not valid YAML"),
])
def test_bad_yaml_is_a_usage_error_in_one_sentence(tmp_path, text, needle):
    path = yaml_file(tmp_path, text)
    with pytest.raises(UsageError) as e:
        resolve(path, NO_FLAGS, environ={})
    msg = one_sentence(e)
    assert needle in msg
    assert str(path) in msg  # names the file


def test_missing_or_directory_or_binary_yaml_is_a_usage_error(tmp_path):
    for path in (tmp_path / "absent.yaml", tmp_path):
        with pytest.raises(UsageError) as e:
            resolve(path, NO_FLAGS, environ={})
        one_sentence(e)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"model: caf\xe9\n")
    with pytest.raises(UsageError) as e:
        resolve(bad, NO_FLAGS, environ={})
    assert "UTF-8" in one_sentence(e)


@pytest.mark.parametrize("field, value", [
    ("tokens", 0), ("tokens", -5), ("tokens", 10**9),
    ("temperature", -1), ("temperature", math.inf), ("temperature", math.nan),
    ("top_p", 0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 2),
    ("top_k", -1), ("penalty", 0.5), ("penalty", math.nan), ("penalty_window", -1), ("chunk", 0),
    ("budget", "0"), ("budget", "abc"), ("budget", "-3"), ("context", -1), ("threads", -1), ("threads", 10**6),
    ("seed", -1), ("seed", 1 << 32),
    ("draft", "everything"), ("template", "poem"), ("device", "tpu"), ("dtype", "int4"),
    ("weights", "int2"), ("weights", "bfloat16"),
    ("dry_multiplier", -0.5), ("dry_base", 0.9), ("dry_allowed_length", 0), ("dry_window", -1),
    ("dry_breakers", "\\n,,:"), ("stop_on_loop", 15), ("stop_on_loop", -1),
])
def test_out_of_range_values_are_refused_from_every_source(tmp_path, field, value):
    sources = {
        "--" + field.replace("_", "-"): lambda: resolve(None, {field: str(value)}, environ={}),
        "SWIFTWRITE_" + field.upper(): lambda: resolve(None, NO_FLAGS, environ={"SWIFTWRITE_" + field.upper(): str(value)}),
        f"{tmp_path / 'run.yaml'}: {field}": lambda: resolve(yaml_file(tmp_path, f"{field}: {value!r}\n".replace("'", '"')),
                                                            NO_FLAGS, environ={}),
    }
    for label, make in sources.items():
        with pytest.raises(UsageError) as e:
            make()
        msg = one_sentence(e)
        assert msg.startswith(label), (label, msg)  # says which flag, variable or file line to fix


@pytest.mark.parametrize("field, value", [("tokens", "abc"), ("tokens", "1e3"), ("temperature", "abc"),
                                          ("top_k", "2.5"), ("seed", "abc"), ("raw", "sometimes")])
def test_values_of_the_wrong_type_are_refused(field, value):
    with pytest.raises(UsageError) as e:
        resolve(None, {field: value}, environ={})
    assert one_sentence(e).startswith("--" + field.replace("_", "-") + " must be")


def test_a_bad_value_below_a_good_override_does_not_matter(tmp_path):
    # The YAML says nonsense for tokens, but the flag replaces it: only the resolved value is checked...
    with pytest.raises(UsageError):  # ...except that types are checked where they are read, so a typo is caught
        resolve(yaml_file(tmp_path, "tokens: lots\n"), {"tokens": "10"}, environ={})
    # a range problem, on the other hand, is judged on the final value
    cfg = resolve(yaml_file(tmp_path, "tokens: 0\n"), {"tokens": "10"}, environ={})
    assert cfg.tokens == 10


def test_coerce_is_strict_about_booleans_posing_as_numbers():
    with pytest.raises(UsageError):
        coerce("tokens", True, "x")
    with pytest.raises(UsageError):
        coerce("temperature", False, "x")
    assert coerce("temperature", 1, "x") == 1.0 and isinstance(coerce("temperature", 1, "x"), float)
    assert coerce("budget", 8, "x") == "8"  # YAML reads `budget: 8` as an int
