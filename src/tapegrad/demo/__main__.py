"""`python -m tapegrad.demo` (`make demo`): the digits MLP and CNN."""

from tapegrad.demo.digits import main

main()
