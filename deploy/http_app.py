"""The one FastAPI app every route of the ingress is declared on.

Route families live in mixin modules (`deploy/admin_routes.py`, ...) whose methods are decorated
`@app.get/post(...)` on this `app`; `OpenAIIngress` lists the mixins among its bases and
`@serve.ingress(app)` serves them all (it scans the class's members, inherited ones included).

The middleware and the exception handler are registered here, before `@serve.ingress` freezes the
app: every route, /health included, runs behind the browser guard.
"""

from fastapi import FastAPI
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.browser_guard import BrowserGuard, BrowserPolicy
from deploy.errors import http_error

# The schema is served by a route of its own, behind the same keys as every other route.
app = FastAPI(title="raylm", docs_url=None, redoc_url=None, openapi_url=None)
# An unknown path or method answers OpenAI error JSON, like every other error.
app.add_exception_handler(StarletteHTTPException, http_error)


def _browser_policy() -> BrowserPolicy:
    """The serving ingress's browser policy (Serve runs a copy of `app`, frozen at decoration, so
    the middleware finds the ingress through the replica's context)."""
    ingress = serve.get_replica_context().servable_object
    return ingress.browser_policy  # type: ignore[attr-defined]


app.add_middleware(BrowserGuard, policy_of=_browser_policy)
