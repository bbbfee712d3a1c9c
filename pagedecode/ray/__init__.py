"""Replicas on Ray Serve (pagedecode[ray]): `build_app(model, num_replicas=2, ...)`, and
`pagedecode serve --ray --replicas N [--ray-address ADDR]`.

    client --HTTP--> Serve proxy --> router (one deployment, the ingress)
                                        |  handle calls, streamed
                                        v
                      replica-0, replica-1, ...  (one deployment each, one engine each)

Each replica runs the server's own ASGI app (server/app.py build_app) over its engine: the
router hands it the request's method, path, headers and body, and relays what the app sends
(status, headers, body chunks) back as it comes. Behaviour is the server's, one code path; the
router only chooses the replica and names it in the `X-Pagedecode-Replica` response header.

Routing keeps the request contract across replicas:
- a request with an `Idempotency-Key` goes to the key's owner on a consistent-hash ring (64
  points per replica), so a retry attaches to its first generation;
- a request id names its replica (each replica's ids start `req-rN-`, EngineConfig's
  request_id_prefix; its Responses API ids `resp_rN-`), so `/v1/requests/{id}/events`, `/trace`
  and `/v1/responses/{id}` reach the replica holding it;
- other completions prefer the replica whose prefix cache likely holds the prompt's start:
  the router keys the prompt's full pages with the prefix cache's own chained page hash
  (runtime/prefix_cache.py page_key, the model name and cache_salt as namespace), remembers
  which keys it sent where, and picks the replica matching the longest chain, unless that one
  has `prefix_load_cap` more requests in flight than the least loaded (then the least loaded);
  routing="round_robin" turns this off (the benchmark's baseline);
- `X-Pagedecode-Replica: replica-N` on a request pins it (a replica's own /metrics, say).

Ray Serve's proxy always answers with its own `X-Request-Id`; the replica's (the pagedecode
request id, also each body's `id`) comes as `X-Pagedecode-Request-Id`. `GET /v1/replicas` is the
router's view: requests in flight per replica, replicas marked down, its routing time.

A replica that dies: its streams end with an error chunk (code replica_failed) and `data:
[DONE]`, a request it had not yet answered gets 503 replica_failed; the router routes around it
(a retry with the same key runs anew on the next live replica on the ring) and probes it until
Ray Serve has started its replacement. Ray Serve's own request router API picks among the
replicas of one deployment from the pickled request; the router deployment here reads headers
and body itself and keeps each replica addressable by name, so it is used instead.
"""
from .app import Spec, build_app
from .cli import serve_main
from .replica import EngineReplica
from .ring import Ring
from .router import Router

__all__ = ["EngineReplica", "Ring", "Router", "Spec", "build_app", "serve_main"]
