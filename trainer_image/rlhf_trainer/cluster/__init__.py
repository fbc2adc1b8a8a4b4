"""Ray, and only here: placement groups per pool (`placement`), the Ray actor that hosts
a worker and the worker group of a role (`groups`), every role's group of a job
(`role_groups`), the sample queue's actor (`queue`), and connecting to a cluster or
simulating one on this machine (`local`)."""
