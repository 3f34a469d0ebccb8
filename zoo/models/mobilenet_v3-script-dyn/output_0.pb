
Boutput_0JPac>´Aq5€4é¬´h 5Önh3¦rÝ³óØL4YÛ4E7ã²‡Hd4B>ý±œ”4³J¾³íf7³_È‘4d´§2‡’·±2lË3‰ L1