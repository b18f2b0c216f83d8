"""`mserve autoscale`: desired replicas per worker pool from load and SLO attainment, applied by a backend.

* ``policy``   pure: observations in, one decision (with its reason) per pool out; no sockets, no clock.
* ``signals``  turns the coordinator's STATUS and the workers' Redis loads into an observation.
* ``backends`` local processes, docker compose, Kubernetes: what each runs to reach a replica count.
* ``runner``   the loop: observe, decide, apply, log.   ``cli``: the command line.

See docs/autoscaling.md.
"""

POOLS = ("encode", "prefill", "decode")
