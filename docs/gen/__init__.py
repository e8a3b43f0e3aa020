"""The docs site's generated pages: the reference read from the code, the performance table
read from the latest bench run (`docs/bench/latest.json`).

`python -m docs.gen OUT` writes every generated page under OUT; `mkdocs build` adds the same
pages through `docs/gen/hook.py`, so the site never shows a copy that drifted from the code.
"""
