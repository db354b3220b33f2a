"""`python -m tapegrad.demo` (`make demo`)."""

from tapegrad.demo.toy import main

main()
