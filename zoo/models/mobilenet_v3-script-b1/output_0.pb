
Boutput_0J(ac>´Aq5€4é¬´h 5Önh3¦rİ³óØL4YÛ4E7ã²