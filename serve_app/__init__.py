"""The OpenAI-compatible Ray Serve application: `serve run serve_app:app [key=value ...]` from a
checkout, `serve run pagedserve.serve_app:app` anywhere pagedserve is installed."""
if __name__ == "serve_app":
    # Imported by the folder's own name (`serve run serve_app:app` in a checkout): hand over
    # pagedserve's module, so that one module object (and one set of deployments) exists.
    import importlib
    import sys

    sys.modules[__name__] = importlib.import_module("pagedserve.serve_app")
else:
    from pagedserve.serve_app.app import APP_NAME, app, build_app
    from pagedserve.serve_app.config import ServeSettings

    __all__ = ["APP_NAME", "app", "build_app", "ServeSettings"]
