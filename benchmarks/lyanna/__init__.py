"""The Lyanna §7 reports, one module each (table1, fig12, table2, fig13a); `benchmarks.lyanna_sweep`
runs them."""
