"""Drafting methods, one proposer each, behind one interface (`proposer.Proposer`);
`registry` maps method names to them."""
