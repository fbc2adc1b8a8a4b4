"""rlhf-operator: reconciles RLHFJobs into KubeRay RayJobs with separated GPU pools."""
