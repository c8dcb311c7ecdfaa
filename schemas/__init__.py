"""What every process shares: the wire contract, and the helpers more than one package needs.

The wire contract (what crosses a process boundary; changing it changes every service and its
SCHEMA_VERSION or topic layout): `messages` (the message kinds and their codec), `fields` (the
codec's bounds and per-token dtypes), `topics` (names, partitions, broker configs), and `weights`,
the weight protocol as one package: the payload format of weight updates, the broadcast's protocol,
and both ends of it, the learner's publisher and the engines' follower (`weights/__init__.py`).

Shared helpers (no wire format; here because `learner`, `producers` and `consumers` never import
each other, so a rule two of them follow has to live below all three): `kafka` and `retry` (client
factories, produce-and-wait, range reads, the transient-error rule), `progress` (consumer lag),
`config` (typed flags and `SAO_*` variables), `files` (a file written whole or not at all, numbered files),
`signing` (the learner's Ed25519 signatures on weights), `http` (the two HTTP servers' guards), `process`
(signals, the CPU's features), `plugins` and `boundary` (loading and calling user code),
`catalogue`, `models` and `tokenizers` (model names every service agrees on).
"""
