"""The OpenAI-compatible Ray Serve application: `serve run serve_app:app [key=value ...]`."""
from serve_app.app import APP_NAME, app, build_app
from serve_app.config import ServeSettings

__all__ = ["APP_NAME", "app", "build_app", "ServeSettings"]
