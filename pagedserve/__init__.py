"""The `pagedserve` command line: `pagedserve serve MODEL [vLLM-style flags]`, `generate`, `chat`,
`bench`. The server itself is `serve_app` (`serve run serve_app:app`); this package only maps a
command line onto its settings."""
