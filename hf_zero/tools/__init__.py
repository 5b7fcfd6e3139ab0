"""Tools on top of the engine and the integrations: the side-by-side bench, the estimator, the notebook helpers."""
