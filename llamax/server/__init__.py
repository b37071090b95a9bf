"""``llamax[server]``: an OpenAI-compatible HTTP server over one shared :class:`llamax.Context`.

>>> import llamax, uvicorn
>>> from llamax.server import create_app
>>> ctx = llamax.Context(n_ctx=4096, n_seq_max=16)                # doctest: +SKIP
>>> uvicorn.run(create_app(ctx), host="127.0.0.1", port=8000)    # doctest: +SKIP

Its settings are one frozen :class:`ServerConfig` (``create_app(ctx, ServerConfig(api_key=
"k"))``, or the same fields as keywords), from which ``llamax serve``'s flags are made.

From a shell: ``llamax serve [MODEL.gguf]`` or ``python -m llamax.server``. Needs the extra:
``pip install '.[server]'`` in a llamax clone (docs/install.md).
"""

try:
    from .app import create_app
    from .background import BackgroundServer
    from .cli import main
    from .config import ServerConfig, ServerSettings
    from .images import ImagePolicy
    from .models import ModelPool
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"llamax.server needs its extra: pip install '.[server]' in a llamax clone ({exc})"
    ) from exc

__all__ = [
    "BackgroundServer",
    "ImagePolicy",
    "ModelPool",
    "ServerConfig",
    "ServerSettings",
    "create_app",
    "main",
]
