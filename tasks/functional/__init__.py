"""Pure functions of tensors: the preference and policy losses, L2 logistic regression, the off-
policy estimators (importance weights, effective sample size). Imports nothing from tasks."""
