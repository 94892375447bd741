"""The pure core: configuration, request ids, readiness signals, the goodput ledger and the step-boundary
planner. No verl, ray, torch or network imports here (tests/test_layers.py imports every module of this
package in a fresh interpreter and fails if one loads them); clocks are injected."""
