"""Drafting methods behind one interface (`proposer.Proposer`); `registry` maps method names to them."""
