# Read by CTest after the discovered tests: the 10.7 GB huge-shape test runs with nothing beside it.
set_tests_properties("HugeShape.Forward1600x16x729x72" PROPERTIES RUN_SERIAL TRUE)
