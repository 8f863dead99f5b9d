"""One router per API area; each route parses, calls one service function, serialises."""
