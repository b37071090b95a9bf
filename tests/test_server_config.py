"""One frozen :class:`~llamax.server.ServerConfig` (issue 58): its fields are the flags of
``llamax serve`` and ``python -m llamax.ray`` (and nothing else is), bad values are refused
with a typed error before a model loads or a port is bound, and ``create_app`` with a config
builds the app its keywords build. A new server setting is one field plus its doc."""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_server_fake import call, fake_context

import llamax
from llamax import InvalidParameterError
from llamax.flags import add_option_flags, option_values
from llamax.optionspec import flag_of, generated_blocks, options_of, spec
from llamax.server import ImagePolicy, ModelPool, ServerConfig, create_app
from llamax.server import cli as serve_cli
from llamax.server.config import SERVER_OPTION_LISTS

DOCS = Path(__file__).resolve().parents[1] / "docs"

LAUNCHER_FLAGS = {
    "help", "model", "host", "port", "shutdown_timeout", "models", "models_dir", "models_max",
    "models_wait", "idle_unload", "lora", "http", "log_level",
}  # fmt: skip
"""``llamax serve``'s own flags: how it loads models and runs uvicorn, not app settings."""
RAY_FLAGS = {
    "help", "model", "address", "host", "port", "replicas", "cpus_per_replica",
    "gpus_per_replica", "routing", "context_options", "server_options",
}  # fmt: skip
"""``python -m llamax.ray``'s own flags: the cluster and the deployment."""


@pytest.fixture
def ctx() -> Iterator[llamax.Context]:
    context = fake_context()
    try:
        yield context
    finally:
        context.close()


def _setting_flags() -> dict[str, str]:
    """``{dest: flag}`` of every setting of ServerConfig, its nested ImagePolicy's included."""
    found = {}
    for option in options_of(ServerConfig):
        inner = [o for o in options_of(ImagePolicy)] if option.name == "images" else [option]
        found |= {o.name: flag_of(o.name, o.spec) for o in inner}
    return found


def _dests(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {a.dest: list(a.option_strings) for a in parser._actions}


def _context_dests() -> set[str]:
    return {o.name for o in options_of(llamax.ContextConfig) if o.spec.flag}


# --- the flags derive from the fields -------------------------------------------------------


def test_every_setting_is_a_serve_flag_and_every_serve_flag_is_a_setting_or_the_launchers() -> None:
    dests = _dests(serve_cli.build_parser())
    settings = _setting_flags()
    for name, flag in settings.items():
        assert flag in dests.get(name, []), f"ServerConfig.{name} has no flag {flag}"
    for dest in dests:
        known = dest in settings or dest in _context_dests() or dest in LAUNCHER_FLAGS
        assert known, f"llamax serve's {dests[dest]} is no ServerConfig field"
    assert "-n" in dests["default_max_tokens"]  # llama-server's short spelling


def test_the_ray_entry_takes_the_same_flags() -> None:
    pytest.importorskip("ray")
    from llamax.ray.__main__ import build_parser

    dests = _dests(build_parser())
    settings = _setting_flags()
    for name, flag in settings.items():
        assert flag in dests.get(name, []), f"python -m llamax.ray has no {flag}"
    for dest in dests:
        assert dest in settings or dest in _context_dests() or dest in RAY_FLAGS, dest


def test_serve_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in _setting_flags().values():
        assert flag in text
    assert "-n N, --n-predict N" in text and "(default: $LLAMAX_API_KEY, else none)" in text


def test_the_flags_give_the_config_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMAX_API_KEY", raising=False)
    parse = serve_cli.build_parser().parse_args
    bare = serve_cli.server_config(parse(["m.gguf"]))
    assert bare == ServerConfig(allowed_hosts=("127.0.0.1",))  # every default, --host added
    args = ["m.gguf", "--api-key", "k", "--max-queue", "3", "--max-body-bytes", "64K",
            "--retry-after-seconds", "5", "--stream-ping-seconds", "0.5", "--lenient",
            "--no-native-cors", "--cors-origin", "http://a.example", "--cors-origin", "*",
            "-n", "7", "--seed", "-1", "--alias", "m", "--max-images-per-request", "2",
            "--image-url-allow-network", "10.0.0.0/8"]  # fmt: skip
    config = serve_cli.server_config(parse(args))
    assert config == ServerConfig(
        api_key="k", max_queue=3, max_body_bytes=64 << 10, retry_after_seconds=5,
        stream_ping_seconds=0.5, lenient=True, native_cors=False,
        cors_origins=("http://a.example", "*"), default_max_tokens=7, default_seed=None,
        model_alias="m", images=ImagePolicy(max_images=2, url_allow_networks=("10.0.0.0/8",)),
        allowed_hosts=("127.0.0.1",),
    )  # fmt: skip
    monkeypatch.setenv("LLAMAX_API_KEY", "from-env")
    assert serve_cli.server_config(parse(["m.gguf"])).api_key == "from-env"
    assert serve_cli.server_config(parse(["--api-key", "flag"])).api_key == "flag"


# --- bad values: a typed error, before anything starts --------------------------------------

BAD = [
    {"max_queue": 0}, {"max_sequences": -1}, {"max_body_bytes": 0}, {"retry_after_seconds": 0},
    {"max_stored_responses": 0}, {"max_queue": 1.5}, {"max_queue": True},
    {"stream_ping_seconds": 0}, {"stream_ping_seconds": float("nan")},
    {"slot_idle_seconds": -1.0}, {"api_key": ""}, {"default_max_tokens": 0},
    {"default_seed": -5}, {"default_seed": 1 << 32}, {"model_alias": ""}, {"lenient": "yes"},
    {"cors_origins": "http://a.example"}, {"allowed_hosts": ["bad host"]},
    {"slot_save_path": ""}, {"images": 4}, {"images": {"max_images": -1}},
    {"images": {"max_image": 4}}, {"max_queue": 1 << 70},
]  # fmt: skip


@pytest.mark.parametrize("bad", BAD, ids=lambda bad: next(iter(bad)))
def test_a_bad_setting_is_a_typed_error_naming_it(bad: dict[str, Any], ctx: llamax.Context) -> None:
    name = next(iter(bad))
    with pytest.raises(InvalidParameterError, match=name.rstrip("s")) as caught:
        ServerConfig.from_options(bad)
    assert caught.value.param is not None and caught.value.param.startswith(name)
    with pytest.raises(InvalidParameterError, match=name.rstrip("s")):
        create_app(ctx, **bad)
    if not isinstance(bad[name], dict):
        with pytest.raises(InvalidParameterError, match=name.rstrip("s")):
            ServerConfig(**bad)


def test_an_unknown_setting_names_the_closest(ctx: llamax.Context) -> None:
    with pytest.raises(TypeError, match="'max_queue'"):
        create_app(ctx, max_queu=3)
    with pytest.raises(TypeError, match="'api_key'"):
        ServerConfig.from_options({"apikey": "k"})
    with pytest.raises(TypeError, match="ServerConfig"):
        create_app(ctx, {"api_key": "k"})  # type: ignore[arg-type]


def test_what_needs_more_than_the_settings_is_checked_by_create_app(
    ctx: llamax.Context, tmp_path: Path
) -> None:
    config = ServerConfig(slot_save_path=tmp_path / "missing")  # a path is taken, kept as text
    assert config.slot_save_path == str(tmp_path / "missing")
    with pytest.raises(InvalidParameterError, match="slot_save_path"):
        create_app(ctx, config)
    pool = ModelPool({"a": "a.gguf"})
    try:
        with pytest.raises(InvalidParameterError, match="alias"):
            create_app(pool, model_alias="x")
    finally:
        pool.close()


def test_bad_serve_flags_exit_2_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loads: list[Any] = []
    monkeypatch.setattr(llamax, "Context", lambda *a, **k: loads.append(a))
    for flags in (["--max-queue", "0"], ["-n", "0"], ["--allowed-hosts", "a b"],
                  ["--image-url-fetches", "99"], ["--stream-ping-seconds", "0"]):  # fmt: skip
        assert serve_cli.main(["m.gguf", "--log-level", "critical", *flags]) == 2
    assert loads == []


def test_bad_ray_flags_exit_2_before_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    from llamax.ray import __main__ as ray_main

    monkeypatch.setattr(ray_main.ray, "init", lambda **_: pytest.fail("Ray started"))
    for argv in (["--max-queue", "0"], ["--server-options", '{"max_queu": 3}'],
                 ["--server-options", '{"images": {"max_images": -1}}']):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            ray_main.main(argv)
        assert exited.value.code == 2


# --- create_app with a config is create_app with keywords -----------------------------------


def test_create_app_with_a_config_is_create_app_with_its_keywords(ctx: llamax.Context) -> None:
    settings: dict[str, Any] = {
        "api_key": "k", "max_queue": 2, "model_alias": "tiny", "default_max_tokens": 2,
        "cors_origins": ["http://a.example"], "images": {"max_images": 1},
    }  # fmt: skip
    config = ServerConfig.from_options(settings)
    assert config.images == ImagePolicy(max_images=1)
    assert config.cors_origins == ("http://a.example",)
    by_config, by_keywords = create_app(ctx, config), create_app(ctx, **settings)
    assert by_config.state.llamax.config == by_keywords.state.llamax.config == config
    over = create_app(ctx, config, max_queue=5, images={"allow_urls": True})
    assert over.state.llamax.config == dataclasses.replace(
        config, max_queue=5, images=ImagePolicy(max_images=1, allow_urls=True)
    )
    key = {"Authorization": "Bearer k"}
    preflight = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    for app in (by_config, by_keywords):
        assert call(app, "GET", "/v1/models").status_code == 401
        assert call(app, "GET", "/v1/models", headers=key).json()["data"][0]["id"] == "tiny"
        answer = call(app, "POST", "/v1/chat/completions", json=body, headers=key).json()
        assert answer["usage"]["completion_tokens"] <= 2  # default_max_tokens
        opened = call(app, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert opened.headers["access-control-allow-origin"] == "http://a.example"
    assert create_app(ctx).state.llamax.config == ServerConfig()


def test_the_state_holds_the_config_not_copies_of_its_fields(ctx: llamax.Context) -> None:
    state = create_app(ctx, max_stored_responses=3).state.llamax
    names = {f.name for f in dataclasses.fields(state)}
    assert not names & {f.name for f in dataclasses.fields(ServerConfig)}
    assert state.config.max_stored_responses == 3


# --- a new setting is one field --------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WithGreeting(ServerConfig):
    """ServerConfig plus one new setting: the whole change a new setting needs."""

    greeting: str = field(
        default="hello", metadata=spec(doc="what the server says first", flag=True)
    )


def test_a_new_setting_reaches_the_flags_and_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_option_flags(parser, WithGreeting)
    help_text = " ".join(parser.format_help().split())
    assert "--greeting GREETING what the server says first (default: hello)" in help_text
    ns = parser.parse_args(["--greeting", "hi", "--max-queue", "4"])
    assert option_values(ns, WithGreeting) == {"greeting": "hi", "max_queue": 4}
    config = WithGreeting.from_flags(ns)
    assert (config.greeting, config.max_queue) == ("hi", 4)


# --- the docs table is the fields' ------------------------------------------------------------


def test_the_docs_tables_of_the_settings_are_current() -> None:
    found = 0
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for current, wanted in generated_blocks(text, SERVER_OPTION_LISTS):
            found += 1
            assert current == wanted, (
                f"{path.name}: a server settings table is stale; run python "
                "scripts/option_tables.py"
            )
    assert found >= 2  # server.md: the flags and the fields


def test_every_setting_has_a_doc() -> None:
    for cls in (ServerConfig, ImagePolicy):
        for f in dataclasses.fields(cls):
            assert f.metadata["llamax"].doc.strip(), f"{cls.__name__}.{f.name} has no doc"


def test_the_typed_keywords_of_create_app_are_the_config_fields() -> None:
    """``create_app(ctx, **settings)`` is typed by ``ServerSettings``: the same names as
    ``ServerConfig``'s fields, and each field's type is one a keyword may take."""
    from llamax.server import ServerSettings

    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    hints = typing.get_type_hints(ServerSettings)
    assert list(hints) == list(fields)
    config_hints = typing.get_type_hints(ServerConfig)
    for name, hint in hints.items():
        given = set(typing.get_args(hint)) or {hint}
        wanted = set(typing.get_args(config_hints[name])) or {config_hints[name]}
        if typing.get_origin(config_hints[name]) is tuple:  # a sequence of names is kept as a tuple
            assert hint == collections.abc.Sequence[str], name
        else:
            assert wanted <= given, (name, hint, config_hints[name])
