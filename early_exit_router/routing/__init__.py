"""Routing decisions: the exit rule (confidence -> entropy cascade, window rules, controller), the expected-gain
policy, the measured cost model, and the n-gram index the suffix drafter reads."""
