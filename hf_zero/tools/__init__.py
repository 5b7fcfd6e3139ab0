"""Tools on top of the engine and the integrations: the side-by-side bench, the estimator, the notebook helpers.
What needs root (the namespace hosts, the link, their process helpers, the capacity table) is the checkout's
benchmarks/, not this package."""
