"""``StepSlider``: an ipywidgets ``IntSlider`` over a tracer's step records plus an ``Output`` that
shows ``view(step_record)`` for the chosen step.

``view`` is any function of one ``StepRecord``: it may return a matplotlib figure (shown, then
closed), a string (printed) or an object with a rich display. The slider moves over the recorded
steps only; nothing is recomputed.

Displayed, it sends the live widget together with a static picture of the state it opens on (a PNG
of the figure, or the text), which a page that runs no widget (the repository's web page, a
notebook viewer) shows in its place; JupyterLab prefers the widget.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from minivllm.trace import StepRecord
from minivllm.learn.viz.records import StepsLike, steps_of


class StepSlider:
    def __init__(self, tracer: StepsLike, view: Callable[..., Any], start: int = 0,
                 description: str = "step", steps: Optional[list[int]] = None,
                 controls: Optional[dict[str, Any]] = None, **view_kwargs: Any):
        """``steps``: indices into the recorded steps to offer (default: all of them).
        ``controls``: {keyword: ipywidget}; each widget's value is passed to ``view`` as that
        keyword and redraws on change (e.g. ``{"position": IntSlider(...)}``)."""
        import ipywidgets as widgets
        self.steps: list[StepRecord] = steps_of(tracer)
        self.indices = list(range(len(self.steps))) if steps is None else list(steps)
        if not self.indices:
            raise ValueError("StepSlider needs at least one step to show.")
        self.view = view
        self.view_kwargs = view_kwargs
        self.controls = dict(controls or {})
        self.slider = widgets.IntSlider(value=min(max(start, 0), len(self.indices) - 1), min=0,
                                        max=len(self.indices) - 1, description=description,
                                        continuous_update=False)
        self.label = widgets.Label()
        self.output = widgets.Output()
        self.widget = widgets.VBox([widgets.HBox([self.slider, self.label, *self.controls.values()]),
                                    self.output])
        for w in [self.slider, *self.controls.values()]:
            w.observe(lambda change: self.update(), names="value")
        self.update()

    @property
    def step(self) -> StepRecord:
        """The record the slider points at."""
        return self.steps[self.indices[self.slider.value]]

    def render(self, i: Optional[int] = None) -> Any:
        """``view`` applied to slider position ``i`` (default: the current one), not displayed."""
        pos = self.slider.value if i is None else i
        kwargs = {**self.view_kwargs, **{k: w.value for k, w in self.controls.items()}}
        return self.view(self.steps[self.indices[pos]], **kwargs)

    def update(self) -> None:
        from IPython.display import display
        self.label.value = f"engine step {self.step.step} ({self.slider.value + 1}/{len(self.indices)})"
        self.output.clear_output(wait=True)
        with self.output:
            result = self.render()
            if hasattr(result, "savefig"):
                import matplotlib.pyplot as plt
                display(result)
                plt.close(result)
            elif isinstance(result, str):
                print(result)
            elif result is not None:
                display(result)

    def static_bundle(self, dpi: int = 72) -> dict[str, str]:
        """The opening state without a widget: {"image/png": base64 PNG, "text/plain": what it
        shows}, or only "text/plain" for a view that returns text."""
        import base64
        import io
        result = self.render()
        text = f"{self.label.value}; move the slider in Jupyter to see the other steps"
        if hasattr(result, "savefig"):
            import matplotlib.pyplot as plt
            buf = io.BytesIO()
            result.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
            plt.close(result)
            return {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": text}
        return {"text/plain": f"{text}\n{result}" if isinstance(result, str) else text}

    def _ipython_display_(self) -> None:
        from IPython.display import display
        bundle = dict(self.widget._repr_mimebundle_() or {})
        bundle.update(self.static_bundle())
        display(bundle, raw=True)
