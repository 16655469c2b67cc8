"""prolog: the compatibility policy and the PrologSlurmctld gate."""
