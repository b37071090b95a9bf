"""llama-server's native API on llamax: ``/completion``, ``/infill``, ``/slots``,
``/props``, ``/apply-template``, the model router (``/models/load`` ...) and llama-server's
extensions of the OpenAI chat route. The table of routes and fields is in docs/server.md.

- :mod:`.fields` holds the ``/completion`` and ``/infill`` fields as request-field tables
  (the parsers' policy and the docs tables), and the one mapping of llama-server's sampling
  names onto :class:`~llamax.SamplingParams` (with ``generation_settings``).
- :mod:`.request` checks a ``/completion`` body and maps it onto llamax's parameters;
  :mod:`.results` shapes every native route's results (one shaper, whole and streamed).
- :mod:`.completion` runs ``/completion``; :mod:`.jobs` runs one sequence on a slot
  (``/infill``, ``/completion`` with ``id_slot``); :mod:`.slots` holds the slots and their
  sessions (save, restore, erase); :mod:`.infill` builds the fill-in-the-middle prompt.
- :mod:`.routes`, :mod:`.infill`, :mod:`.slots` and :mod:`.router` hold the routes;
  :mod:`.errors` the error shape; :mod:`.chat` the chat route's extensions.
"""

from .chat import timed_response_events, with_llama_extras
from .infill import infill_routes
from .router import router_routes
from .routes import llama_routes
from .slots import slot_routes, slot_tables

__all__ = [
    "infill_routes",
    "llama_routes",
    "router_routes",
    "slot_routes",
    "slot_tables",
    "timed_response_events",
    "with_llama_extras",
]
