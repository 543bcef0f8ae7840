"""The whole text form of a panel in a saved notebook (ipywidgets cuts it at 110 characters)."""

from __future__ import annotations


class FullTextForm:
    """Mix in before an ipywidgets class: the notebook's text/plain is the whole repr, so a
    notebook saved without widget state still shows every figure."""

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            data["text/plain"] = repr(self)
        return data
