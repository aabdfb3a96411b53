"""The typed protocol layer: every dialect the server speaks, declared once as pydantic
models, checked before any model loads, translated into the library's one generation
request, and answered through one streaming path.

Modules:

- ``common`` — :class:`~.common.Shape` (the base of every request shape: JSON's own types,
  unknown fields refused by name unless null, ``IGNORED`` fields accepted, ``REFUSED``
  fields declared but refused until implemented), :func:`~.common.parse` (the body reader
  of :mod:`localrun.server.params` first — size, depth, digits, text — then the shape),
  :func:`~.common.from_validation` (a validation error → one 400 naming the field),
  :class:`~.common.Generation` (the library's one generation request; ``check()`` runs
  the library's own checks of sampling, messages, tools and schemas before any load) and
  :func:`~.common.respond` (run it, answer one JSON body or stream the dialect's Wire).
- ``blocks`` — the one tool-call assembly for dialects whose reply is a list of blocks:
  :class:`~.blocks.Blocks` (chunks → block start/delta/stop events) and
  :class:`~.blocks.BlockWire`; :func:`~.blocks.sse`.
- ``spec`` — the route registry (:func:`~.spec.operation`), ``/openapi.json`` built from
  the models, and the endpoint list an unknown path's 404 names.
- ``openai``, ``ollama``, ``anthropic`` — each dialect's shapes and its Wire encoders.

Errors: every :class:`~localrun.server.errors.APIError` is written in the shape of the
path it answers (:func:`localrun.server.errors.shape_of`): Ollama's under ``/api/``,
Anthropic's under ``/v1/messages``, OpenAI's elsewhere — middleware refusals (401, 403,
413, 415) included. A failure after a stream began is the Wire's ``error()`` event.

Adding a dialect (the OpenAI Responses API, say):

1. Shapes, in ``protocol/responses.py``: the request as ``Shape`` subclasses (nested
   parts too; a part the library reads whole, like a JSON Schema holder, as ``Passed``).
   Fields clients send that change nothing go in ``IGNORED``; fields not supported yet
   are declared and listed in ``REFUSED`` with the reason; anything else undeclared is
   refused by name automatically. Cross-field rules go in ``refuse()`` (call
   ``super().refuse()``), raising :func:`~.common.refused` or :func:`~.common.invalid`
   with the sub-field's name, so the 400 names the full path. The answer and each stream
   event as plain ``BaseModel`` s (build them with only the fields to send: ``dump()`` and
   ``event_json()`` write the fields that were set).
2. Translation: a ``generation()`` method building a :class:`~.common.Generation` —
   ``messages`` in the library's OpenAI-style form (``role``, ``content``,
   ``tool_calls`` with JSON-text ``arguments``, ``tool`` turns with ``tool_call_id``),
   ``sampling`` with the library's names (``max_tokens``, ``temperature``, ``top_p``,
   ``top_k``, ``stop``, ...), ``structured`` as ``Model.stream`` takes it
   (``response_format``, ``tools`` as OpenAI function dicts, ``tool_choice``), ``names``
   mapping library names to the dialect's (``{"max_tokens": "max_output_tokens",
   "response_format": "text.format"}``) — and ending with ``.check()``.
3. The stream: subclass :class:`~.blocks.BlockWire`; write ``begin()`` (e.g.
   ``response.created``), ``event(BlockEvent)`` (a text block's start/delta/stop →
   output_item.added / output_text.delta / output_item.done; a tool call's →
   function_call_arguments.delta, with the whole arguments on its stop), ``end(completion)``
   (``response.completed`` with usage) and ``error(APIError)``. ``blocks_of(completion)``
   gives the same blocks for the non-streamed answer. ``job.stream.prompt_tokens`` is
   known at ``begin()``; ``job.stream.stop_sequence`` at the end.
4. Routes, in ``server/<dialect>_api.py``: decorate with ``**operation(METHOD, PATH,
   DIALECT, request=..., response=..., stream=...)`` (it is then in /openapi.json and
   in the 404's list), ``req = await parse(request, Shape)``, ``gen = req.generation()``,
   ``return await respond(request, endpoint, gen, lambda job: Wire(...), lambda job, c:
   answer)``; include the router in ``app.create_app``. A dialect with its own error
   shape adds its prefix to ``errors.SHAPES`` and a ``*_body()``; the Responses API uses
   OpenAI's (the default).
5. Tests: the official client on the preloaded test model (tests/serverutil.py), a bad
   request refused before any load (tests/test_server_protocol.py), and the route is in
   the schemathesis run (tests/test_openapi_fuzz.py) by itself.
"""
