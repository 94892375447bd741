"""The step boundary, above the policies: the planner (`planner.py`) decides from one snapshot of the readiness
signals, and a round (`round.py`) applies its decision through a port that trainer `tide` implements with verl
and the simulator on its model. Pure Python: no verl, ray or torch."""
