// Validation tests: one per rule (being written).
