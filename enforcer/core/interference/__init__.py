"""`vram-enforcer interference`, the pure part: what is measured, and what it means.

One module per job: `workloads` (what to measure, from the command line), `plan` (which
runs), `outcomes` (what one run came to), `stats` (the figures: medians, slowdowns,
spreads, overlaps) and `report` (text, markdown and JSON).

Given the workloads, `plan` says which runs to make (warm-ups, each workload alone, each
pair together), `classify` turns what `exec` said about one run into its outcome,
`read_section` checks the section a workload timed itself, and `analyse` turns every run
into the report: per workload and neighbour, the slowdown (median time next to the
neighbour over median time alone), the peak GPU memory, what went wrong, how stable the
figures are and how much the two runs of a pair overlapped. The report is then text,
markdown or a JSON document. The mode (`enforcer.modes.interference`) does the running.

Whose time: a workload that does its start-up (importing a framework, creating a CUDA
context, loading data) before its work may time the work itself and write the section to
the file named by `TIMING_ENV`; its figures are then those sections, which its start-up
no longer dilutes toward 1.00x. Otherwise they are exec's times of the whole command.
"""
