"""What several test modules share, by topic; a test module imports from here, never from another test module
(``tests/unit/test_test_layout.py`` checks it)."""
