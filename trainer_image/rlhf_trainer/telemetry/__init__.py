"""What a run tells the world: Prometheus metrics (`metrics`), the timeline of which
role ran which phase on which pool (`timeline`), and status reports to the RLHFJob or
the console (`report`)."""
